"""Framework-neutral pieces (no torch import): :mod:`primus_turbo.common.constants`."""
