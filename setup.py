from setuptools import find_packages, setup

setup(
    name="hvd_topk",
    version="0.1.0",
    description="Top-K gradient compression with error feedback for Horovod + PyTorch",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hvd_topk", "hvd_topk.*"]),
    python_requires=">=3.9",
    # horovod is built from source by scripts/install.sh (C++17 fix); torch is pinned there too.
    install_requires=["horovod==0.28.1", "torch>=2.1", "numpy", "mpi4py"],
    extras_require={"test": ["pytest", "pytest-timeout", "hypothesis", "scikit-learn"]},
)
