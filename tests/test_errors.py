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


def test_an_error_raised_over_a_sigterm_as_it_unwinds_is_the_sigterms_stop():
    """SIGTERM inside torch.save: the zip writer's __exit__ fails on the cut file ("unexpected pos")
    and its RuntimeError replaces the Terminated. The run was stopped by the signal: exit 143 (not 1),
    and summary.json says interrupted."""
    from eyas.cli import exit_status

    def unwound(stop: BaseException) -> BaseException:
        try:
            try:
                raise stop
            finally:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
        except RuntimeError as e:
            return e

    sigterm = unwound(errors.Terminated("SIGTERM"))
    assert errors.stopped_by(sigterm).signum == 15 and exit_status(sigterm) == 143
    assert exit_status(unwound(errors.Terminated("SIGHUP"))) == 129
    assert exit_status(unwound(KeyboardInterrupt())) == 130
    assert errors.stopped_by(RuntimeError("a plain failure")) is None and exit_status(RuntimeError("x")) == 1
