"""The learner node: the transport shell around an algorithm core (``zddrl.algos``) - polls the data
channel, runs sync rounds or the async stream, publishes parameters, keeps the run's ledger and run
directory."""
