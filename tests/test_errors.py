"""eyas.errors: secrets are hidden in every message, without garbling the rest."""

from __future__ import annotations

from eyas import errors


def test_a_short_secret_is_hidden_only_where_it_stands_alone():
    """A long key is hidden wherever it appears; a short one (`EMPTY`, a one-letter password) only as
    a word of its own, not inside `eyas extract: error`."""
    added = {"e", "EMPTY", "sk-abcdefgh123"} - errors.SECRETS
    try:
        for secret in added:
            errors.add_secret(secret)
        said = errors.redact("eyas extract: error: key EMPTY refused; Bearer sk-abcdefgh123, xsk-abcdefgh123y; e=e")
        assert said == "eyas extract: error: key *** refused; Bearer ***, x***y; ***=***"
    finally:
        errors.SECRETS.difference_update(added)
