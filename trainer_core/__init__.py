"""trainjobs' training engine: usable on its own, with no API, queue or database."""

from trainer_core.spec import JobSpec, SpecError, load_spec_file, parse_spec

__all__ = ["JobSpec", "SpecError", "load_spec_file", "parse_spec"]
