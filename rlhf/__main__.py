from rlhf.cli import main

raise SystemExit(main())
