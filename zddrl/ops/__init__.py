"""Operating a run: ``zddrl train`` (the local fleet of processes), status, plots and evaluation."""
