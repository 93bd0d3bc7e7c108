"""eyas: train EAGLE-3 speculative-decoding drafts for any Hugging Face causal LM."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: `import eyas` stays cheap (no torch import) for the CLI's --help.
    if name == "Prepared":
        from eyas.prepared import Prepared

        return Prepared
    if name == "HiddenStates":
        from eyas.hidden_states import HiddenStates

        return HiddenStates
    raise AttributeError(name)
