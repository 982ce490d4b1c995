"""The one thing pyproject.toml cannot say: the packages are found (every folder under `deltares/`
and `kernels_pallas/`, so new ones are not forgotten) and, besides them, the repository's top-level
`experiments/` ships inside the package as `deltares/experiments` (`--config tiny:delta_block`
then works from any directory; see deltares.command_line)."""

from setuptools import find_namespace_packages, setup

PACKAGES = find_namespace_packages(include=["deltares", "deltares.*", "kernels_pallas", "kernels_pallas.*"],
                                   exclude=["*.__pycache__"])

setup(packages=PACKAGES + ["deltares.experiments"], package_dir={"deltares.experiments": "experiments"})
