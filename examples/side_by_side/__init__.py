"""One agent, trained by Agent Lightning or by Fulmen: ``agent.py`` (see docs/from-agent-lightning.md)."""
