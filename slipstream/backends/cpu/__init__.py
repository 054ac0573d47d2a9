"""The CPU backend: native C kernels (kernels/*.c, built by build.py, declared in abi.py) with
plain torch wherever they do not run."""
