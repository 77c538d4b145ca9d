"""Training scripts launched by `hf-stable <command>` through `accelerate launch`."""
