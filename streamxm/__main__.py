from streamxm.cli import main

raise SystemExit(main())
