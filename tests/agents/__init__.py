"""Small agents the runner tests run: they import nothing of Fulmen's."""
