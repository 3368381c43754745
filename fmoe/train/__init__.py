"""The training job (`fmoe train`): config, data, optimizer, checkpoints, the per-rank loop; the library
never imports it."""
