"""Benchmarks that study zddrl rather than size a deployment, run from a checkout: ``python -m benchmarks NAME``.

Outside the installed package: the fleet simulator (``fleet``), the relay (``relay``), the replay buffer, its
service and the off-policy learners (``replay``), the scaling curve (``scale``) and the side-by-side harness with
Stable-Baselines3 (``train``). What a user runs on their own hardware stays in ``zddrl bench`` (zddrl.bench);
these share its building blocks (zddrl.bench.common). docs/benchmarks.md has the commands and the figures.
"""
