"""Code several families share (no family's own): flow matching on packed latents, a transformer
read block by block (stream), the diffusers image pipeline parts, single-file readers, tiny model
parts, loss weighting."""
