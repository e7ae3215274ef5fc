"""The one error a bad config raises: a line naming the key, the value and what is allowed."""


class ConfigError(ValueError):
    """A bad config value; the message is one line naming the key, the value and what is allowed."""
