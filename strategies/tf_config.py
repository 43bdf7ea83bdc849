"""Reading the `TF_CONFIG` environment variable, with errors that quote it."""

import json
import os

# Longer TF_CONFIGs are cut to this many characters in error messages.
MAX_QUOTED_CHARS = 200


def load(environ=os.environ):
    """Returns the parsed `TF_CONFIG` of `environ`.

    Args:
        environ: the environment to read `TF_CONFIG` from.

    Returns:
        Its dict, or None when it is unset or blank.

    Raises:
        ValueError: if it is not valid JSON or not a JSON object; the
            message quotes it.
    """
    text = environ.get("TF_CONFIG", "")
    if not text.strip():
        return None
    # TensorFlow's own readers (`TFConfigClusterResolver`) parse it when
    # first asked, so a typo surfaces as a bare `JSONDecodeError` that never
    # says which text was wrong.
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"TF_CONFIG must be valid JSON, but is not ({error}); received "
            f"{_quoted(text)}."
        ) from None
    if not isinstance(config, dict):
        raise ValueError(
            'TF_CONFIG must be a JSON object such as {"cluster": {...}, '
            f'"task": {{...}}}}; received {_quoted(text)}.'
        )
    return config


def _quoted(text):
    """`text` as a Python literal, cut to `MAX_QUOTED_CHARS` characters."""
    if len(text) > MAX_QUOTED_CHARS:
        return repr(text[:MAX_QUOTED_CHARS]) + f" (cut from {len(text)} characters)"
    return repr(text)
