"""The one exception k3.chat raises for a request it cannot render or a tokenizer it cannot use."""


class ChatFormatError(ValueError):
    """A conversation, option or tokenizer that K3's chat format cannot express; the message says which and why."""
