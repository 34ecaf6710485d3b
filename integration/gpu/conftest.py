"""GPU suites need triton; a machine without it skips collecting them instead of failing on import."""
import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("triton") else ["test_*.py"]
