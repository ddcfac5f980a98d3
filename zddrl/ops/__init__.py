"""Operating a run: ``zddrl train`` (the local processes of a run, restarted when the learner dies),
status, plots and evaluation."""
