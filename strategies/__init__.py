"""The distribution side of tf_agn: strategy builders and their flags."""
