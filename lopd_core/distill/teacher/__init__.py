"""What the teacher reads besides latents and how it plays: the baselines' text contexts and the EMA teacher
(baselines.py), the latent teacher playing tasks (teacher_rollout.py) and its measured ceiling (teacher_play.py).
The teacher's passes are scoring/teacher.py; the step's context for it (step 2a) is update/update.py's
`teacher_context`, which reads the update's typed inputs."""
