"""Facts about this process and machine, and helpers over the OS, one module per concern.

- :mod:`._platform`: heap trimming, usable cores, available memory, the map limit, the CPU's
  fingerprint;
- :mod:`._onnxruntime`: which onnxruntime distributions are installed;
- :mod:`._children`: the environment of Python child processes, and what killed one;
- :mod:`._hashing`: the one hashing writer, and file digests;
- :mod:`._files`: opening a file below a folder without following symlinks, file kinds,
  durable renames;
- :mod:`._filesystems`: the file system that holds a path, and whether it is remote.

Modules that need one of these import it from its module, so that a platform difference is
handled in one place.
"""
