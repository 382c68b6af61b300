"""The composer φ: experiences to latent tokens (composer.py), its encoder's LoRA (encoder_lora.py) and cache
(lru.py), the reading term KL(p_text ‖ p_latent) (reading.py), and the fits before distillation: φ0's cold start on
the pretraining worlds (coldstart.py, coldstart_data.py) and the in-world fit (world_fit.py)."""
