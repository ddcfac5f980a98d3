"""Actor hosts: step the envs with the newest policy (numpy inference, no torch), ship trajectories.
Imports protocol, transport and the torch-free parts of algos."""
