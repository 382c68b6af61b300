"""The LOPD core: losses for the student (reverse KL toward the latent teacher) and the composer."""
