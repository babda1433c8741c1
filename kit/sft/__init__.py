"""The second article's path, made correct: TRL's SFTTrainer under `accelerate launch`, on the
kit's model, LoRA, data and adapter save (the kit's own recipe is kit.train on kit.recipe).

    accelerate launch --config_file accelerate.yaml -m kit.sft.trainer config.yaml

    trainer.py  the entry: the run, the adapter gathered, checked and saved as kit.train saves it
    setup.py    what the trainer is given (SFTConfig from a kit config) and what accelerate started
"""
