"""How training is backed up and resumed, on the same or another replica count."""
