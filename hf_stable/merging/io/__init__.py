"""Safetensors I/O for the merge engine: our own header parser, a `pread` row reader and a streaming writer.

* `header`: `TensorInfo`, `ModelCheckpoint.open(path)`, `parse_safetensors_header(path)`. No torch import.
* `reader`: `SafetensorsReader` (`read_rows`, `read_tensor`), cached file descriptors, optional fadvise.
* `writer`: `StreamingSafetensorsWriter` (header up front, `pwrite` of row tiles, index at `finalize`).

Import the submodules directly, e.g. `from hf_stable.merging.io.reader import SafetensorsReader`; this package
imports nothing so that header parsing stays torch-free.
"""
