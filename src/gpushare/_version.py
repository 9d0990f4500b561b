"""The one place the version is written (pyproject, the CLI, the exporter and the
manifests' image tag read it; tests/deploy checks the tag)."""

__version__ = "0.1.0"
