"""Formats: `open` detects what a path holds (`_open`); sources for safetensors
(`_safetensors`, and `save_safetensors`), Orbax (`_orbax`) and TensorFlow
(`_tensorflow`) checkpoints; `convert` between formats (`_convert`). Imported by module
path; this face holds nothing."""
