from ssh_scheduler.cli import class_code

class_code.install()  # before the command's modules make their dataclasses

from ssh_scheduler.cli.main import main  # noqa: E402

main()
