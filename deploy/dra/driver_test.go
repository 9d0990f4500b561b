package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"reflect"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
)

func claimFor(memory string, params ...string) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "c", UID: "u1"}}
	alloc := &resourceapi.AllocationResult{}
	alloc.Devices.Results = []resourceapi.DeviceRequestAllocationResult{{
		Request: "gpu", Driver: driverName, Pool: "node", Device: "gpu-0",
		ConsumedCapacity: map[resourceapi.QualifiedName]resource.Quantity{"memory": resource.MustParse(memory)},
	}}
	for _, p := range params {
		alloc.Devices.Config = append(alloc.Devices.Config, resourceapi.DeviceAllocationConfiguration{
			Source: resourceapi.AllocationConfigSourceClaim,
			DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{
				Driver: driverName, Parameters: runtime.RawExtension{Raw: []byte(p)},
			}},
		})
	}
	c.Status.Allocation = alloc
	return c
}

// fakeNode records what the driver tells the node; err, where set, is the node's refusal.
type fakeNode struct {
	prepared   []prepared
	unprepared []types.UID
	err        error
}

func (f *fakeNode) prepare(p prepared) error {
	if f.err != nil {
		return f.err
	}
	f.prepared = append(f.prepared, p)
	return nil
}

func (f *fakeNode) unprepare(uid types.UID) error {
	if f.err != nil {
		return f.err
	}
	f.unprepared = append(f.unprepared, uid)
	return nil
}

func testDriver(t *testing.T) (*driver, *fakeNode) {
	n := &fakeNode{}
	return &driver{
		socket: "/run/gpushare/workload.sock", cdiDir: t.TempDir(), node: n,
		statuses: newClaimStatus(nil), prepared: map[types.UID]prepared{},
		gpus: []gpu{{Index: 0, UUID: "GPU-1", MemoryBytes: 4 << 30}},
	}, n
}

var ctx = context.Background()

const paramsHead = `{"apiVersion":"gpushare.io/v1alpha1","kind":"GPUShareClaimParameters",`

func TestDraPrepareWritesOneSpecAgainAndUnprepareRemovesIt(t *testing.T) {
	d, n := testDriver(t)
	c := claimFor("1Gi", paramsHead+`"memoryLimit":"2Gi","weight":1}`, paramsHead+`"weight":3,"computeLimit":0.25}`)
	c.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{
		{Resource: "pods", Name: "p2", UID: "pod-2"}, {Resource: "pods", Name: "p1", UID: "pod-1"},
		{APIGroup: "example.com", Resource: "things", Name: "t", UID: "thing-1"},
	}
	devs, err := d.prepare(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	if len(devs) != 1 || devs[0].CDIDeviceIDs[0] != "gpushare.io/claim=u1-0" {
		t.Fatalf("devices %+v", devs)
	}
	first, err := os.ReadFile(d.specPath("u1"))
	if err != nil {
		t.Fatal(err)
	}
	var spec cdiSpec
	if err := json.Unmarshal(first, &spec); err != nil {
		t.Fatal(err)
	}
	got := strings.Join(spec.Devices[0].Edits.Env, " ")
	// the claim's later config overrides the weight, keeps the limit
	want := "GPUSHARE_SOCKET=/run/gpushare/workload.sock NVIDIA_VISIBLE_DEVICES=GPU-1 GPUSHARE_MEMORY=1073741824 GPUSHARE_MEMORY_LIMIT=2147483648 GPUSHARE_WEIGHT=3 GPUSHARE_COMPUTE_LIMIT=0.25 GPUSHARE_CLAIM=u1"
	if got != want {
		t.Fatalf("env %q, want %q", got, want)
	}
	// the node was told the claim's share, its pods only (not other consumers)
	told := prepared{UID: "u1", Namespace: "ns", Name: "c", GPU: 0, Pods: []string{"pod-1", "pod-2"},
		MemoryRequest: 1 << 30, MemoryLimit: 2 << 30, Weight: 3, ComputeLimit: 0.25, Pool: "node", Device: "gpu-0"}
	if len(n.prepared) != 1 || !reflect.DeepEqual(n.prepared[0], told) {
		t.Fatalf("told the node %+v, want %+v", n.prepared, told)
	}
	if _, err := d.prepare(ctx, c); err != nil {
		t.Fatal(err)
	}
	again, _ := os.ReadFile(d.specPath("u1"))
	if string(again) != string(first) {
		t.Fatalf("prepared twice, specs differ")
	}
	entries, _ := os.ReadDir(d.cdiDir)
	if len(entries) != 1 {
		t.Fatalf("%d files in the CDI folder, want 1 (no temporary left)", len(entries))
	}
	for range 2 { // the kubelet may ask again: unprepared already is no error
		errs, err := d.UnprepareResourceClaims(ctx, []kubeletplugin.NamespacedObject{{UID: "u1"}})
		if err != nil || errs["u1"] != nil {
			t.Fatalf("unprepare: %v %v", err, errs)
		}
		if _, err := os.Stat(d.specPath("u1")); !os.IsNotExist(err) {
			t.Fatalf("unprepared, the spec is still there: %v", err)
		}
	}
	if !reflect.DeepEqual(n.unprepared, []types.UID{"u1", "u1"}) || len(d.claims()) != 0 {
		t.Fatalf("unprepared on the node %v, still prepared %v", n.unprepared, d.claims())
	}
}

func TestDraPrepareRefusesALimitBelowTheRequestAndAnUnknownDevice(t *testing.T) {
	d, n := testDriver(t)
	_, err := d.prepare(ctx, claimFor("2Gi", paramsHead+`"memoryLimit":"1Gi"}`))
	if err == nil || !strings.Contains(err.Error(), "memoryLimit 1Gi is below") {
		t.Fatalf("error %v", err)
	}
	c := claimFor("1Gi")
	c.Status.Allocation.Devices.Results[0].Device = "gpu-7"
	if _, err := d.prepare(ctx, c); err == nil || !strings.Contains(err.Error(), "gpu-7 is not one of this node's GPUs") {
		t.Fatalf("error %v", err)
	}
	if _, err := os.Stat(d.specPath("u1")); !os.IsNotExist(err) {
		t.Fatalf("a refused claim left a spec: %v", err)
	}
	if len(n.prepared) != 0 {
		t.Fatalf("a refused claim was told the node: %+v", n.prepared)
	}
}

func TestDraPrepareRefusesTwoSharesInOneClaimAndWhatTheNodeRefuses(t *testing.T) {
	d, n := testDriver(t)
	c := claimFor("1Gi")
	second := c.Status.Allocation.Devices.Results[0]
	second.Request = "gpu2"
	c.Status.Allocation.Devices.Results = append(c.Status.Allocation.Devices.Results, second)
	if _, err := d.prepare(ctx, c); err == nil || !strings.Contains(err.Error(), "2 gpushare devices allocated") {
		t.Fatalf("error %v", err)
	}
	n.err = errors.New("gpushare ctl claim: prepare_claim: gpu 0: this node has GPUs 0..-1")
	if _, err := d.prepare(ctx, claimFor("1Gi")); err == nil || !strings.Contains(err.Error(), "claim ns/c: gpushare ctl claim") {
		t.Fatalf("error %v", err)
	}
	if _, err := os.Stat(d.specPath("u1")); !os.IsNotExist(err) || len(d.claims()) != 0 {
		t.Fatalf("a claim the node refused left a spec (%v) or a record %v", err, d.claims())
	}
	// unprepare the node refuses keeps the spec: the kubelet asks again
	n.err = nil
	if _, err := d.prepare(ctx, claimFor("1Gi")); err != nil {
		t.Fatal(err)
	}
	n.err = errors.New("node away")
	errs, _ := d.UnprepareResourceClaims(ctx, []kubeletplugin.NamespacedObject{{UID: "u1", NamespacedName: types.NamespacedName{Namespace: "ns", Name: "c"}}})
	if errs["u1"] == nil {
		t.Fatal("the node's refusal to unprepare was not passed on to the kubelet")
	}
	if _, err := os.Stat(d.specPath("u1")); err != nil {
		t.Fatalf("unprepare failed, yet the spec is gone: %v", err)
	}
}

func TestDraAPluginStartedAgainTellsTheNodeItsClaimsFromTheSpecs(t *testing.T) {
	d, _ := testDriver(t)
	for i, uid := range []types.UID{"u2", "u1"} {
		c := claimFor("1Gi")
		c.UID, c.Name = uid, fmt.Sprintf("c%d", i)
		if _, err := d.prepare(ctx, c); err != nil {
			t.Fatal(err)
		}
	}
	// a spec of another kind in the folder, and a broken one, are left alone
	if err := os.WriteFile(d.cdiDir+"/gpushare.io-claim_broken.json", []byte("{"), 0o644); err != nil {
		t.Fatal(err)
	}
	again, n := testDriver(t)
	again.cdiDir = d.cdiDir
	if err := again.loadPrepared(); err != nil {
		t.Fatal(err)
	}
	again.resend()
	if got := len(n.prepared); got != 2 || n.prepared[0].UID != "u1" || n.prepared[1].Name != "c0" {
		t.Fatalf("told the node again %+v, want u1 then u2 (c0)", n.prepared)
	}
	if !reflect.DeepEqual(again.claims(), d.claims()) {
		t.Fatalf("read back %+v, prepared %+v", again.claims(), d.claims())
	}
}

func TestDraAClaimsShareIsItsSessionsOnItsGPU(t *testing.T) {
	p := prepared{UID: "u1", GPU: 1, MemoryRequest: 1 << 30, MemoryLimit: 2 << 30, Weight: 2}
	st := status{GPUs: []gpu{
		{Index: 0, Sessions: []session{{ID: 1, Claim: "u1", State: "holding", ResidentBytes: 99}}},
		{Index: 1, Simulated: true, Sessions: []session{
			{ID: 2, Claim: "u1", State: "waiting", ResidentBytes: 10, SwappedBytes: 5},
			{ID: 3, Claim: "u9", State: "holding", ResidentBytes: 7},
			{ID: 4, Claim: "u1", State: "yielding", ResidentBytes: 20},
		}},
	}}
	want := share{MemoryRequestBytes: 1 << 30, MemoryLimitBytes: 2 << 30, Weight: 2, Sessions: 2,
		State: "yielding", ResidentBytes: 30, SwappedBytes: 5, Simulated: true}
	if got := shareOf(p, st); got != want {
		t.Fatalf("share %+v, want %+v", got, want)
	}
	if got := shareOf(p, status{}); got.Sessions != 0 || got.State != "" {
		t.Fatalf("no sessions: %+v", got)
	}
}
