import os

# Lightning's tips and the bare "GPU available" banner only clutter test output.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
