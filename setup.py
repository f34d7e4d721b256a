"""amp_rewrite: automatic mixed precision for TensorFlow graphs by graph rewriting."""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent

setup(
    name="amp_rewrite",
    version="0.1.0",
    description="Rewrite TensorFlow graphs and SavedModels to float16/bfloat16 mixed precision",
    long_description=(HERE / "README.md").read_text(encoding="utf-8") if (HERE / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["amp_rewrite", "amp_rewrite.*"]),
    package_data={"amp_rewrite.cli": ["templates/*.j2"]},
    data_files=[("share/amp_rewrite/lists", [str(p) for p in sorted((HERE / "lists").glob("*.yaml"))])],
    install_requires=[
        "tensorflow>=2.16,<2.22",
        "networkx>=3.0",
        "pyyaml>=6.0",
        "protobuf>=4.21",
        "tqdm>=4.60",
        "jinja2>=3.1",
    ],
    extras_require={
        "test": ["pytest>=7", "hypothesis>=6", "scikit-learn>=1.3", "tf-keras>=2.16,<2.22", "tensorboard>=2.16,<2.22"],
    },
    entry_points={"console_scripts": ["amp-rewrite=amp_rewrite.cli:main"]},
)
