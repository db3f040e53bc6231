"""Sharding over several processes with FSDP2: the trained model (`fsdp2`) and the frozen text encoders
(`text_encoders`, ``--fsdp_text_encoder``)."""
