"""Learner shards: the torch.distributed group (``group``) and the device plan and launcher (``launch``)."""
