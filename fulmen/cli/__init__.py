"""The ``fulmen`` command line."""
