package main

import (
	"context"
	"encoding/json"
	"os"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
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

func testDriver(t *testing.T) *driver {
	return &driver{socket: "/run/gpushare/workload.sock", cdiDir: t.TempDir(), gpus: []gpu{{Index: 0, UUID: "GPU-1", MemoryBytes: 4 << 30}}}
}

const paramsHead = `{"apiVersion":"gpushare.io/v1alpha1","kind":"GPUShareClaimParameters",`

func TestDraPrepareWritesOneSpecAgainAndUnprepareRemovesIt(t *testing.T) {
	d := testDriver(t)
	c := claimFor("1Gi", paramsHead+`"memoryLimit":"2Gi","weight":1}`, paramsHead+`"weight":3}`)
	devs, err := d.prepare(c)
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
	want := "GPUSHARE_SOCKET=/run/gpushare/workload.sock NVIDIA_VISIBLE_DEVICES=GPU-1 GPUSHARE_MEMORY=1073741824 GPUSHARE_MEMORY_LIMIT=2147483648 GPUSHARE_WEIGHT=3"
	if got != want {
		t.Fatalf("env %q, want %q", got, want)
	}
	if _, err := d.prepare(c); err != nil {
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
		errs, err := d.UnprepareResourceClaims(context.Background(), []kubeletplugin.NamespacedObject{{UID: "u1"}})
		if err != nil || errs["u1"] != nil {
			t.Fatalf("unprepare: %v %v", err, errs)
		}
		if _, err := os.Stat(d.specPath("u1")); !os.IsNotExist(err) {
			t.Fatalf("unprepared, the spec is still there: %v", err)
		}
	}
}

func TestDraPrepareRefusesALimitBelowTheRequestAndAnUnknownDevice(t *testing.T) {
	d := testDriver(t)
	_, err := d.prepare(claimFor("2Gi", paramsHead+`"memoryLimit":"1Gi"}`))
	if err == nil || !strings.Contains(err.Error(), "memoryLimit 1Gi is below") {
		t.Fatalf("error %v", err)
	}
	c := claimFor("1Gi")
	c.Status.Allocation.Devices.Results[0].Device = "gpu-7"
	if _, err := d.prepare(c); err == nil || !strings.Contains(err.Error(), "gpu-7 is not one of this node's GPUs") {
		t.Fatalf("error %v", err)
	}
	if _, err := os.Stat(d.specPath("u1")); !os.IsNotExist(err) {
		t.Fatalf("a refused claim left a spec: %v", err)
	}
}
