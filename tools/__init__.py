"""Developer tools for sharedml: benchmark model generators (not part of the package)."""
