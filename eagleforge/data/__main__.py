from eagleforge.cli import run_main
from eagleforge.data.stage import main

if __name__ == "__main__":
    run_main(main, "data stage: prompts -> conversations -> token rows with assistant loss masks", sections=("target", "data"))
