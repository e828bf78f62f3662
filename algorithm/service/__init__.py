"""The trainer service (``fulmen train``): dispatch tasks (``dispatcher``, ``stored_tasks``), collect transitions
into complete groups (``collector``, ``groups``), turn them into samples with advantages (``samples``), train and
publish each version (``loop``), replay stored rollouts (``replay``), gate promotion on held-out accuracy
(``promotion``); ``run`` wires them to Kafka and a trainer backend (:func:`run.run_trainer`)."""
