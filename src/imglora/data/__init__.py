"""Image datasets: reading images safely, aspect-ratio buckets, scanning a dataset folder."""
