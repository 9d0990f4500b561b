package main

// kubelet-call: the two calls the kubelet makes to a DRA plugin, NodePrepareResources
// and NodeUnprepareResources (DRA gRPC v1), made to the plugin's socket as the
// kubelet makes them. For checking a node's plugin by hand and for the tests, where
// no kubelet runs: the reply is printed as JSON.

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
)

const callUsage = "usage: gpushare-dra kubelet-call --plugin-socket PATH prepare|unprepare NAMESPACE NAME UID"

func kubeletCall(args []string) error {
	fs := flag.NewFlagSet("kubelet-call", flag.ContinueOnError)
	sock := fs.String("plugin-socket", "/var/lib/kubelet/plugins/"+driverName+"/dra.sock", "the plugin's DRA socket")
	timeout := fs.Duration("timeout", 30*time.Second, "how long the call may take")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() != 4 || (fs.Arg(0) != "prepare" && fs.Arg(0) != "unprepare") {
		return fmt.Errorf("%s", callUsage)
	}
	conn, err := grpc.NewClient("unix://"+*sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	c := drapb.NewDRAPluginClient(conn)
	claims := []*drapb.Claim{{Namespace: fs.Arg(1), Name: fs.Arg(2), Uid: fs.Arg(3)}}
	var reply any
	if fs.Arg(0) == "prepare" {
		reply, err = c.NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{Claims: claims})
	} else {
		reply, err = c.NodeUnprepareResources(ctx, &drapb.NodeUnprepareResourcesRequest{Claims: claims})
	}
	if err != nil {
		return fmt.Errorf("%s: %w", fs.Arg(0), err)
	}
	return json.NewEncoder(os.Stdout).Encode(reply)
}
