"""The RL maths, torch and nothing else of Fulmen's but its errors: credit assignment across an episode's calls
(``credit``, ``anchor``), advantage estimators (``advantages``), policy losses and their reductions (``losses``),
off-policy corrections (``corrections``), reward shaping (``shaping``), the named recipes that combine them
(``recipes``), and the registry each is chosen from by name (``registry``)."""
