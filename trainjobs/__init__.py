"""trainjobs: the CLI, the Python client and the local launcher."""
