from ssh_scheduler.cli.main import main

main()
