"""ConfigError: a bad config value or key. str() is one line that says what to change."""


class ConfigError(ValueError):
    """A bad config value or key; str() is one line that says what to change."""
