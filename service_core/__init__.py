"""State and queue shared by the API and the worker: settings, database, status vocabulary, keys,
artifacts, logging and enqueueing. Imports trainer_core at most; never api, worker or trainjobs."""
