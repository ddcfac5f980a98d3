"""Learner shards: the torch.distributed group (``shards``) and the device plan and launcher (``launch``)."""
