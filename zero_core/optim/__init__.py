"""The optimizer over this rank's shards: which optimizers fit and how one is rebuilt in place
(``rebuild.py``), what its param groups list (``param_groups.py``), fp16 loss scaling
(``loss_scaling.py``), and gradient norms and clipping from the shards (``grad_ops.py``)."""
