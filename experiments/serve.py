"""python -m experiments.serve [group=option] [key=value]: an OpenAI-compatible HTTP endpoint over any
deployment. The server itself is serving.http.server; this is its hydra entry point."""

import hydra
from omegaconf import DictConfig

from experiments.config import run_job


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from serving.http.server import serve

    run_job(serve, cfg)


if __name__ == "__main__":
    main()
