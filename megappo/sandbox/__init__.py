"""The python sandbox: code a model wrote runs here only (docs/SANDBOX.md). run.py launches a call (its limits, its
own root, namespaces, the system-call filter; `run_python`), child.py builds the minimal root inside the new
namespaces, syscalls.py is the allow-list. Below the multi-turn loop's python tool (agent/tools.py) and the code
reward (rewards/code.py), which both call `run_python`; it imports neither."""
