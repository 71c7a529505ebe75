"""Lightning plugins other than strategies: the precision plugin (``precision.py``, its FP32 master weights in
``master_weights.py``), the checkpoint IO plugins
(``checkpoint_io.py``: atomic files and the sharded directory's staging) and the asynchronous checkpoint writer
(``async_checkpoint.py``) the strategies use with ``async_checkpoint=True``."""
