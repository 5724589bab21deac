"""The Lightning strategy "shard_fsdp_tp" (built by the strategy issue on top of lightning_shard)."""
